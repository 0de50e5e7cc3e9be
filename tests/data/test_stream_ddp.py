"""Two ranks over gloo on CPU: equal batch counts in lockstep, exact resume on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from omniloom.data.stream.stream_bench import synthetic_documents, write_shards

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from omniloom.data.config import DataConfig, SourceConfig
    from omniloom.data.stream import build_loader
    from omniloom.data.stream.stream_bench import SyntheticTokenizer

    shards, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    tok = SyntheticTokenizer()
    cfg = DataConfig(sources=[SourceConfig(path=shards)], seq_len=128, batch_size=2, num_workers=2,
                     shuffle_buffer=4, pack_buffer=4, seed=11)

    def run(loader, n):
        digests = []
        for batch in loader:
            batch.validate()
            digests.append(batch.digest())
            step = torch.tensor([1])
            dist.all_reduce(step)  # a DDP step: hangs if one rank ran dry
            assert int(step) == world
            if len(digests) == n:
                break
        return digests

    kw = dict(rank=rank, world_size=world, patch_dim=tok.tubelet_dim)
    full_loader = build_loader(cfg, tok, **kw)
    full = run(full_loader, 14)
    first = build_loader(cfg, tok, **kw)
    head = run(first, 7)
    resumed = build_loader(cfg, tok, **kw)
    resumed.load_state_dict(first.state_dict())
    tail = run(resumed, 7)
    json.dump({"full": full, "resumed": head + tail, "epochs": list(full_loader.epochs().values())},
              open(os.path.join(out, f"rank{rank}.json"), "w"))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gloo_equal_counts_and_exact_resume(tmp_path):
    # 3 uneven shards (odd count) for 2 ranks x 2 workers; 14 steps cross the epoch end.
    shards = write_shards(str(tmp_path / "s"), synthetic_documents(23, seed=4, mean_text=60), name="s",
                          docs_per_shard=[9, 8, 6])
    script = tmp_path / "ddp_stream.py"
    script.write_text(SCRIPT)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), shards, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for res in results:
        assert len(res["full"]) == 14 and res["resumed"] == res["full"]
        assert min(res["epochs"]) >= 1, "the run crossed an epoch end on every rank"
    # Within the first epoch the ranks read disjoint samples (later epochs reshuffle, and a long
    # document split into pieces can give the same batch on another rank then).
    assert not set(results[0]["full"][:3]) & set(results[1]["full"][:3]), "ranks read disjoint data"
