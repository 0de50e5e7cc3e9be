"""Issue 14, item 8: a `.ts` file is TypeScript unless it really is an MPEG transport stream. A
short file that is not UTF-8 and starts with `G` (the 0x47 sync byte) is too short to hold the
packets of a stream, so it is code, decoded under the usual rules, and never a `not-a-video` reject."""

from __future__ import annotations

import json
from pathlib import Path

from omniloom.data.ingest import IngestSettings, discover
from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.shards import build
from omniloom.data.synth import make_video
from omniloom.data.validate import TextPolicy

# Windows-1252 TypeScript (Spanish strings), 268 bytes: shorter than three 188-byte packets.
GREETER = (
    'GLOBAL_GREETING = "¡Buenos días, señor García! ¿Cómo está usted esta mañana?";\n'
    'export const despedida = "Adiós, hasta mañana; que tenga un buen día en la oficina.";\n'
    "export function saludo(nombre: string): string { return `${GLOBAL_GREETING} Bienvenido, ${nombre}.`; }\n"
)


def _docs(out: Path) -> dict[str, dict]:
    docs = {}
    for shard in read_manifest(out)["shards"]:
        for smp in shard["samples"]:
            _, members = iter_sample_at(out / shard["name"], smp["offset"])
            doc = json.loads(members["doc.json"])
            docs[doc["meta"]["source"].split("/", 1)[1]] = doc
    return docs


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]


def test_a_short_non_utf8_ts_file_starting_with_G_is_code_not_a_video(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = GREETER.encode("cp1252")
    assert data[:1] == b"G" and 188 < len(data) < 3 * 188 and data[188] != 0x47
    (src / "Greeter.ts").write_bytes(data)
    (src / "G.ts").write_bytes(b"G" + b"\xa0\xe9" * 93 + b"G" + b"\xe9" * 187)  # sync bytes at both strides, 2 packets
    make_video(src / "clip.ts", frames=8)  # a real transport stream stays a video
    kinds = {u.rel: (u.kind, u.lang) for u in discover([str(src)])}
    assert kinds == {"Greeter.ts": ("code", "typescript"), "G.ts": ("code", "typescript"), "clip.ts": ("video", "")}

    s = build([str(src)], str(tmp_path / "out"), progress=False)
    rejects = {r["path"].rsplit("/", 1)[1]: r for r in _rejects(tmp_path / "out")}
    assert s["documents"] == 2 and s["rejects"] == {"encoding-detected": 1, "bad-utf8": 1}, rejects
    docs = _docs(tmp_path / "out")
    assert docs["Greeter.ts"]["segments"][0] == {"type": "code", "lang": "typescript", "text": GREETER}
    assert docs["clip.ts"]["meta"]["media"]["vid0.ts"]["container"] == "mpegts"
    assert rejects["Greeter.ts"]["code"] == "encoding-detected" and rejects["G.ts"]["code"] == "bad-utf8"

    # Without detection the short file is still code: a bad-utf8 reject, not not-a-video.
    s = build([str(src)], str(tmp_path / "strict"), progress=False, ingest=IngestSettings(text=TextPolicy(undeclared_encoding="utf-8")))
    assert s["documents"] == 1 and s["rejects"] == {"bad-utf8": 2}, _rejects(tmp_path / "strict")
