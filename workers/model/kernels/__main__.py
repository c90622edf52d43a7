"""`python -m workers.model.kernels`: build (or find) the CPU kernels ahead of the first worker."""
import logging
import sys

from workers.model.kernels import cpu_kernels

logging.basicConfig(level=logging.INFO)
sys.exit(0 if cpu_kernels() is not None else 1)
