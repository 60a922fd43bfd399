"""Input pipelines: `batches`, `shuffled`, Grain's iterators, and the checks and placement of one batch."""
from ._data import batches as batches
from ._data import shuffled as shuffled
from ._grain import GrainBatches as GrainBatches
from ._grain import grain_batches as grain_batches
