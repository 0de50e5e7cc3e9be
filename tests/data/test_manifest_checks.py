"""Issue 39 (hardening, round 3), items 3 and 8: one manifest check (data/manifest.py
`check_manifest`) for every reader. A shard path that leaves the shard folder, and a manifest of
the wrong shape, are refused in one line naming the file and the key by `train` / `eval` (the
stream's `resolve_source`), `data verify`, `data stats` and `data inspect` alike; an index keeps
naming its shards by absolute path or URL."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from omniloom.data.config import SourceConfig
from omniloom.data.stream.reader import resolve_source
from omniloom.data.stream.stream_bench import synthetic_documents, write_shards
from omniloom.pretrain.cli import main


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("man")
    return write_shards(str(root / "good"), synthetic_documents(6, seed=3, mean_text=60), name="g", docs_per_shard=[3, 3])


def _edited(built, tmp_path, edit) -> str:
    folder = str(tmp_path / "edited")
    shutil.copytree(built, folder)
    path = os.path.join(folder, "manifest.json")
    man = json.loads(open(path).read())
    man = edit(man)
    with open(path, "w") as f:
        json.dump(man, f)
    return folder


def _every_reader_refuses(folder: str, capsys, *needles: str) -> None:
    """resolve_source (what `train` and `eval` build their loaders with) raises one ValueError, and
    each data command exits 2 with one `error:` line; every message names manifest.json and `needles`."""
    with pytest.raises(ValueError) as err:
        resolve_source(SourceConfig(path=folder))
    message = str(err.value)
    assert "manifest.json" in message and all(n in message for n in needles), message
    for command in (["data", "verify", folder], ["data", "stats", folder], ["data", "inspect", folder]):
        capsys.readouterr()
        assert main(command) == 2, command
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("omniloom: error: ") and "manifest.json" in lines[0], (command, lines)
        assert all(n in lines[0] for n in needles), (command, lines)


def _outside(tmp_path, name: str) -> str:
    """A real tar outside the folder, so that a reader that follows the path finds something to read."""
    target = tmp_path / "elsewhere.tar"
    return name.replace("TARGET", str(target))


@pytest.mark.parametrize("name", ["../elsewhere.tar", "TARGET", "sub/../../elsewhere.tar"],
                         ids=["dotdot", "absolute", "nested-dotdot"])
def test_a_shard_named_outside_the_folder_is_refused_by_every_reader(built, tmp_path, capsys, name):
    shutil.copy(os.path.join(built, "g-000001.tar"), tmp_path / "elsewhere.tar")
    name = _outside(tmp_path, name)

    def edit(man):
        man["shards"][1]["name"] = name
        return man

    folder = _edited(built, tmp_path, edit)
    _every_reader_refuses(folder, capsys, "shards[1].name", repr(name), "outside the shard folder")


def test_a_shard_name_that_stays_inside_still_reads(built, tmp_path):
    def edit(man):
        man["shards"][0]["name"] = "./g-000000.tar"
        man["shards"][1]["name"] = "sub/../g-000001.tar"
        return man

    folder = _edited(built, tmp_path, edit)
    os.makedirs(os.path.join(folder, "sub"))
    assert resolve_source(SourceConfig(path=folder)).num_samples == 6


def test_an_index_keeps_absolute_paths_and_urls_but_not_a_relative_escape(built, tmp_path):
    """`data index` writes each shard's absolute path or URL (docs/data-format.md): still read. A
    relative url that climbs out of the index folder is not something it writes: refused."""
    from omniloom.data.manifest import check_manifest

    entry = {"name": "00000.tar", "bytes": 10, "mtime_ns": -1, "num_samples": 0, "samples": []}
    man = {"format": "omniloom-shards", "version": 1, "kind": "index", "shards": []}
    for url in (str(tmp_path / "x.tar"), "https://host/laion-000000.tar", "pipe:cat /data/x.tar", "x.tar"):
        check_manifest({**man, "shards": [{**entry, "url": url}]}, "idx/manifest.json")
    with pytest.raises(ValueError, match=r"idx/manifest.json: shards\[0\].url '\.\./x.tar' points outside the index folder"):
        check_manifest({**man, "shards": [{**entry, "url": "../x.tar"}]}, "idx/manifest.json")
    # a build manifest's `url` key means nothing; its name does
    with pytest.raises(ValueError, match=r"shards\[0\].name '/etc/passwd' is an absolute path"):
        check_manifest({**man, "kind": "shards", "shards": [{**entry, "name": "/etc/passwd"}]}, "b/manifest.json")


def _drop(key):
    def edit(man):
        del man["shards"][0][key]
        return man
    return edit


@pytest.mark.parametrize("edit,needles", [
    (lambda man: [man["shards"]], ("not an omniloom shard manifest",)),  # a list at top level
    (lambda man: {k: v for k, v in man.items() if k != "shards"}, ("'shards' is missing",)),
    (lambda man: {**man, "shards": {"g-000000.tar": 3}}, ("'shards' is a dict",)),
    (lambda man: {**man, "shards": ["g-000000.tar"]}, ("shards[0] is a str",)),
    (_drop("name"), ("shards[0].name is missing",)),
    (lambda man: {**man, "shards": [{**man["shards"][0], "name": 7}]}, ("shards[0].name is 7",)),
    (lambda man: {**man, "shards": [{**man["shards"][0], "samples": "many"}]}, ("shards[0].samples is a str",)),
    (lambda man: {**man, "shards": [{**man["shards"][0], "bytes": "3 KB"}]}, ("shards[0].bytes is '3 KB'",)),
    (lambda man: {**man, "shards": [{**man["shards"][0], "sha256": None}]}, ("shards[0].sha256 is None",)),
    (lambda man: {**man, "totals": [6]}, ("'totals' is a list",)),
    (lambda man: {**man, "totals": {"documents": "six"}}, ("totals.documents is 'six'",)),
    (lambda man: {**man, "name": ["g"]}, ("'name' is ['g']",)),
], ids=["list", "no-shards", "shards-dict", "shard-str", "no-name", "name-int", "samples-str", "bytes-str", "sha-none",
        "totals-list", "documents-str", "name-list"])
def test_a_malformed_manifest_is_one_line_for_every_reader(built, tmp_path, capsys, edit, needles):
    """verify and stats crashed with KeyError / TypeError where train and eval gave one line."""
    _every_reader_refuses(_edited(built, tmp_path, edit), capsys, *needles)


def test_verify_and_stats_report_missing_optional_keys_instead_of_crashing(built, tmp_path, capsys):
    """Keys a reader can do without (a shard's sha256, num_samples, bytes, a sample's key, the
    totals): training reads on (a sample without an offset is a counted `bad_offset` skip), verify
    names each one as a problem, stats summarizes what is there."""
    def edit(man):
        for key in ("sha256", "num_samples", "bytes"):
            del man["shards"][0][key]
        man["shards"][1]["samples"][1] = ["?"]
        del man["totals"]
        return man

    folder = _edited(built, tmp_path, edit)
    assert resolve_source(SourceConfig(path=folder)).num_samples == 6
    assert main(["data", "verify", "--no-media", folder]) == 1
    out = capsys.readouterr().out
    for needle in ("g-000000.tar: the manifest has no sha256", "num_samples=nothing", "samples[1] has no key or no byte offset",
                   "totals.documents is missing"):
        assert needle in out, out
    assert main(["data", "stats", folder]) == 0
    assert "6 documents in 2 shards" in capsys.readouterr().out


def test_data_commands_other_than_index_refuse_an_index_in_one_line(built, tmp_path, capsys):
    def edit(man):
        man["kind"] = "index"
        for s in man["shards"]:
            s["url"] = os.path.join(built, s["name"])
        return man

    folder = _edited(built, tmp_path, edit)
    for command in ("verify", "stats"):
        assert main(["data", command, folder]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "kind 'index'" in err[0] and "`omniloom data build`" in err[0], err
