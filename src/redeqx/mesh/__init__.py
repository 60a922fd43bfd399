"""The device mesh and where arrays live on it: `make_mesh`, the spec checks, `shard`, `constrain`."""

from ._constrain import constrain as constrain
from ._mesh import (
    CONTEXT as CONTEXT,
    DATA as DATA,
    MODEL as MODEL,
    STAGE as STAGE,
    check_mesh as check_mesh,
    make_mesh as make_mesh,
    mesh_text as mesh_text,
    same_devices as same_devices,
    traced_platform as traced_platform,
)
from ._placement import (
    named_shardings as named_shardings,
    place as place,
    place_tree as place_tree,
    replicate_key as replicate_key,
    shard as shard,
    sharding_of as sharding_of,
)
from ._spec_checks import (
    check_key as check_key,
    check_leaf as check_leaf,
    check_specs as check_specs,
    check_specs_match as check_specs_match,
    refuse_deleted as refuse_deleted,
)
