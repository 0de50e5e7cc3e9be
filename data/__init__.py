"""omniloom.data: ingest and shard writing (data prep), shard reading, packing, PackedBatch."""
