"""python -m bench (torchrun --nproc_per_node 2 -m bench --quick): bench/compare.py's command line, ours against PyTorch's own, side by side."""
from bench.compare import main
from foundations.world import exit_distributed

main()
exit_distributed()
