"""Input pipelines: `batches`, `shuffled`, Grain's iterators, and the checks and placement of one batch."""

from ._batch import (
    batch_size as batch_size,
    check_batch as check_batch,
    narrow_64bit as narrow_64bit,
    place_batch as place_batch,
)
from ._data import (
    batches as batches,
    every_example as every_example,
    fn_name as fn_name,
    global_batch_size as global_batch_size,
    local_rows as local_rows,
    to_global as to_global,
    to_host as to_host,
)
from ._grain import GrainBatches as GrainBatches, grain_batches as grain_batches
from ._prefetch import DEFAULT_PREFETCH as DEFAULT_PREFETCH, prefetched as prefetched
from ._shuffled import shuffled as shuffled
