"""Training: ``computron train``, a decoder of this project trained with AdamW and gradient
accumulation, colocation-aware (``colocate/client.py``). ``Trainer`` and ``TrainConfig`` live in
``job.py``, token data in ``data.py``."""
