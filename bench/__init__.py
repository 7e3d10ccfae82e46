"""fp16cb's benchmark, run from a checkout (not installed with the package): `python -m bench --help`.
`workloads` (models and batches), `modes` (how each learner trains), `measure` (clocks, memory, the bookkeeping bound),
`plain` (the plain PyTorch AMP reference loop), `run` (the interleaved driver, the targets, the tables)."""
import fp16cb  # noqa: F401 (first: it imports fastai quietly, and patches Learner.to_fp16 & co.)
from .run import run_bench, defaults, targets, format_table, main, Batches, CPU_MODES, GPU_MODES
from .workloads import WORKLOADS, WORKLOAD_SETS, CPU_SCALE
from .modes import MODES, OPTS
from .measure import move_state
from .plain import PlainAMP

__all__ = ['run_bench', 'defaults', 'targets', 'format_table', 'main', 'Batches', 'CPU_MODES', 'GPU_MODES', 'WORKLOADS',
           'WORKLOAD_SETS', 'CPU_SCALE', 'MODES', 'OPTS', 'move_state', 'PlainAMP']
