#!/usr/bin/env bash
# On a lent machine with 4 GPUs (kind nvidia-h200-x4 or nvidia-h100-x4): the model-parallel runs,
# in stages named on the command line (default: all, in this order):
#   topo     how the GPUs are linked (nvidia-smi topo -m) and the machine
#   test     tests/gpu/test_parallel_gpu.py: tp=2, pp=2, tp=2 x pp=2 over NCCL give tp=1's greedy tokens;
#            tests/gpu/test_striped_gpu.py: striped swap-in lands byte for byte, tokens as unstriped
#   swap[:T,P] aggregate swap-in of OPT-13B at tp=1, 2, 4 and pp=2, 4 against a raw pinned memcpy of every
#            rank's shard on its own GPU at once (each repeat timed by its slowest rank), or the layout named
#   rr[:T,P] the original Computron experiment (round-robin, 2 copies of OPT-13B, 24 blocking requests),
#            both policies in the same run, at (tp, pp) = (1,1), (4,1), (2,1), (1,4), (1,2), (2,2), or the
#            layouts named (rr:1,1 rr:2,2 ...)
#   striped  bench/striped_swap.py on 2 and 4 GPUs: a tp=1 model's image striped over every GPU's host
#            link and gathered over NVLink, against one link's memcpy and k concurrent memcpys
#   gap      bench/load_gap.py at tp=4: loads of two host images of OPT-13B (reloaded, alternated, under a
#            request), on 4 KiB pages then on 2 MiB ones (COMPUTRON_HOST_HUGE_PAGES)
# Results land in $OUT/multi (or bench/results/multi when OUT is unset). NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=${OUT:-bench/results}/multi
mkdir -p "$R"
C="python3 -m computron.cli"
stages=("$@"); [ ${#stages[@]} -gt 0 ] || stages=(topo test swap rr striped)
for st in "${stages[@]}"; do
  echo "== $st $(date -u +%T)"
  case $st in
    topo)
      nvidia-smi -L; nvidia-smi topo -m | tee "$R/topo.txt"
      python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" ;;
    test)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_parallel_gpu.py tests/gpu/test_striped_gpu.py 2>&1 \
        | tee "$R/test_parallel_gpu.log" | tail -5 ;;
    swap|swap:*)
      layouts=("1 1" "2 1" "4 1" "1 2" "1 4"); [ "$st" = swap ] || layouts=("${st#swap:}")
      for l in "${layouts[@]}"; do
        set -- ${l/,/ }
        $C bench swap opt-13b --tp $1 --pp $2 --repeats 5 --decode-tokens 0 --no-naive \
          --out "$R/swap_opt-13b_tp$1_pp$2.json" | tail -4
      done ;;
    rr|rr:*)
      layouts=("1 1" "4 1" "2 1" "1 4" "1 2" "2 2"); [ "$st" = rr ] || layouts=("${st#rr:}")
      for l in "${layouts[@]}"; do
        set -- ${l/,/ }
        $C bench round-robin opt-13b -n 2 -r 24 --blocking --tp $1 --pp $2 \
          --out "$R/round_robin_opt-13b_tp$1_pp$2_n2_r24_blocking.json" | tail -5
      done ;;
    striped)
      python3 bench/striped_swap.py --model opt-13b --gpus 2 4 --out "$R/striped_swap.json" ;;
    gap)
      python3 bench/load_gap.py --model opt-13b --tp 4 --out "$R/load_gap_opt-13b_tp4_pp1.json" ;;
    *) echo "unknown stage $st" >&2; exit 2 ;;
  esac
done
