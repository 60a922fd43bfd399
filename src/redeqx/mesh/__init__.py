"""The device mesh and where arrays live on it: `make_mesh`, the spec checks, `shard`, `constrain`."""
