"""The napkin math: bytes per rank, step time, the machines, the advisor's flow chart, and the experiments that measure them."""
