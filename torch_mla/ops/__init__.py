"""The torch.library boundary: op schemas, validation, dispatch to kernel or reference."""

from .. import fake_impls  # noqa: F401  (registers the fake implementations)
from . import absorb  # noqa: F401  (the modules' absorbed projections)
from .cache import append_kv
from .checks import set_value_checks
from .decode import mla_decode
from .schedule import DecodeSchedule, get_decode_schedule

__all__ = ["DecodeSchedule", "append_kv", "get_decode_schedule", "mla_decode", "set_value_checks"]

from .indexer import append_index_keys, indexer_logits, indexer_topk  # noqa: E402, F401
from .sparse import get_sparse_decode_schedule, mla_decode_sparse  # noqa: E402, F401
