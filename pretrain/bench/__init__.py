"""Benchmarks of the pretrain rooms: every one prints figures against a reference measured in the
same run. `cli.py` registers the `omniloom bench NAME` commands; the rest run as
`python -m omniloom.pretrain.bench.NAME` (expert_parallel, integrity, selector, and gpu_check /
gpu_rows on a CUDA machine). Nothing in the library imports this package.
"""
