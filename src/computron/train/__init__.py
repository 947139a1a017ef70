"""Training: ``computron train``, a decoder of this project trained with AdamW and gradient
accumulation, colocation-aware (``colocate/client.py``), over one process or several (data, tensor
and pipeline parallelism, ``dist.py``). ``Trainer`` and ``TrainConfig`` live in ``job.py``, token
data in ``data.py``; ``launch.py`` runs a planner's plan, ``accuracy.py`` checks the planner against runs."""
