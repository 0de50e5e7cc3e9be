"""Data-prep hardening (issue 14, items 5-13): each test reproduces a failure found by adversarial
testing of `omniloom data build|merge|verify`. Item 6 also covers text that declares no encoding:
its legacy encoding is detected (`--undeclared-encoding detect`) and kept only when the guess is
confident; valid UTF-8 never reaches the detector; JSON stays UTF-8."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from omniloom.data.prep import validate
from omniloom.data.prep.ingest import discover
from omniloom.data.prep.units import IngestSettings
from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.prep.shards import build
from omniloom.data.prep.synth import make_video
from omniloom.data.prep.textenc import detect_encoding
from omniloom.data.prep.validate import Reject, TextPolicy, decode_bytes, decode_text


def _docs(out: Path) -> list[dict]:
    man = read_manifest(out)
    docs = []
    for shard in man["shards"]:
        for smp in shard["samples"]:
            _, members = iter_sample_at(out / shard["name"], smp["offset"])
            docs.append(json.loads(members["doc.json"]))
    return docs


def _rejects(out: Path) -> list[dict]:
    path = out / "rejects.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def _by_source(out: Path) -> dict[str, dict]:
    """The documents of a build keyed by their input's path inside its source folder."""
    return {d["meta"]["source"].split("/", 1)[1]: d for d in _docs(out)}


# --- item 8: a TypeScript file that starts with "G" is code, an MPEG-TS file is a video ----------


def test_typescript_starting_with_G_is_code_and_mpegts_is_video(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "Greeter.ts").write_text("GLOBAL = 1;\nexport class Greeter { greet() { return 'hi ' + GLOBAL; } }\n")
    make_video(src / "clip.ts", frames=8)
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 2, _rejects(tmp_path / "out")
    by_type = {d["segments"][0]["type"]: d for d in _docs(tmp_path / "out")}
    assert by_type["code"]["segments"][0]["lang"] == "typescript"
    assert by_type["code"]["segments"][0]["text"].startswith("GLOBAL = 1;")
    assert by_type["video"]["meta"]["media"]["vid0.ts"]["container"] == "mpegts"


# Windows-1252 TypeScript (Spanish strings), 268 bytes: shorter than three 188-byte packets.
GREETER = (
    'GLOBAL_GREETING = "¡Buenos días, señor García! ¿Cómo está usted esta mañana?";\n'
    'export const despedida = "Adiós, hasta mañana; que tenga un buen día en la oficina.";\n'
    "export function saludo(nombre: string): string { return `${GLOBAL_GREETING} Bienvenido, ${nombre}.`; }\n"
)


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
    docs = _by_source(tmp_path / "out")
    assert docs["Greeter.ts"]["segments"][0] == {"type": "code", "lang": "typescript", "text": GREETER}
    assert docs["clip.ts"]["meta"]["media"]["vid0.ts"]["container"] == "mpegts"
    assert rejects["Greeter.ts"]["code"] == "encoding-detected" and rejects["G.ts"]["code"] == "bad-utf8"

    # Without detection the short file is still code: a bad-utf8 reject, not not-a-video.
    s = build([str(src)], str(tmp_path / "strict"), progress=False, ingest=IngestSettings(text=TextPolicy(undeclared_encoding="utf-8")))
    assert s["documents"] == 1 and s["rejects"] == {"bad-utf8": 2}, _rejects(tmp_path / "strict")


# --- item 13: NaN / Infinity in input JSON never reach doc.json ---------------------------------


def _strict_loads(raw: bytes):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(raw.decode("utf-8"), parse_constant=refuse)


def test_nan_and_infinity_become_null_and_are_counted(tmp_path):
    from omniloom.data.prep.synth import make_image

    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text(
        '{"schema": 1, "segments": [{"type": "text", "text": "score me"}], "meta": {"score": NaN, "w": -Infinity, "big": 1e999, "ok": 0.5}}\n'
    )
    make_image(src / "pic.png", size=(32, 32))
    (src / "pic.json").write_text('{"caption": "a picture", "aesthetic": NaN}')
    out = tmp_path / "out"
    s = build([str(src)], str(out), progress=False)
    assert s["documents"] == 2 and s["rejects"] == {"non-finite-number": 2}
    man = read_manifest(out)
    for shard in man["shards"]:
        for smp in shard["samples"]:
            _, members = iter_sample_at(out / shard["name"], smp["offset"])
            _strict_loads(members["doc.json"])
    metas = {d["segments"][0]["type"]: d["meta"] for d in _docs(out)}
    assert metas["text"]["score"] is None and metas["text"]["w"] is None and metas["text"]["big"] is None and metas["text"]["ok"] == 0.5
    assert metas["image"]["sidecar"] == {"caption": "a picture", "aesthetic": None}
    rej = _rejects(out)
    assert {r["action"] for r in rej} == {"nulled-values"} and all(r["code"] == "non-finite-number" for r in rej)
    for name in ("manifest.json", "rejects.jsonl"):
        for line in (out / name).read_bytes().splitlines() if name.endswith("l") else [(out / name).read_bytes()]:
            _strict_loads(line)


# --- item 11: a build that writes nothing is an error; verify calls an empty set a problem --------


def test_empty_build_exits_2_and_verify_flags_the_empty_set(tmp_path, capsys):
    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.txt").write_bytes(b"")
    out = tmp_path / "out"
    assert main(["-q", "data", "build", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "wrote no documents" in err and "rejects.jsonl" in err
    assert [r["code"] for r in _rejects(out)] == ["empty"]  # the reasons are kept
    assert main(["-q", "data", "build", str(src), "--out", str(out)]) == 2  # a rerun too
    capsys.readouterr()
    assert main(["-q", "data", "verify", str(out)]) == 1
    assert "empty" in capsys.readouterr().out
    (tmp_path / "none").mkdir()
    assert main(["-q", "data", "build", str(tmp_path / "none"), "--out", str(tmp_path / "out2")]) == 2
    # One empty part of a --part build is fine (few inputs, many parts); merge refuses an empty whole.
    assert main(["-q", "data", "build", str(src), "--out", str(tmp_path / "p0"), "--part", "0/2"]) == 0
    assert main(["-q", "data", "build", str(src), "--out", str(tmp_path / "p1"), "--part", "1/2"]) == 0
    assert "holds no documents" in capsys.readouterr().err
    assert main(["-q", "data", "merge", str(tmp_path / "p0"), str(tmp_path / "p1"), "--out", str(tmp_path / "m")]) == 2


# --- item 9: one build at a time per output folder ---------------------------------------------


def _spawn_build(src, out, *extra, pause="0"):
    import subprocess
    import sys

    env = {**os.environ, "OMNILOOM_TEST_BUILD_PAUSE": pause}
    return subprocess.Popen([sys.executable, "-m", "omniloom.data.cli", "build", str(src), "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)


def _wait_for(cond, what, timeout=60.0):
    import time

    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_second_build_into_a_busy_folder_is_refused_naming_the_holder(tmp_path, capsys):
    import signal

    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"t{i}.txt").write_text(f"document number {i}\n")
    out = tmp_path / "out"
    p = _spawn_build(src, out, "--shard-docs", "2", pause="0.2")
    _wait_for(lambda: any(f.name.endswith(".tar.tmp") for f in out.iterdir()) if out.exists() else False, "the first build")
    for extra in ([], ["--overwrite"]):
        assert main(["-q", "data", "build", str(src), "--out", str(out), "--shard-docs", "2", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "in use by another running data build" in err and f"pid {p.pid} " in err, err
    assert p.wait(timeout=60) == 0, p.stderr.read().decode()
    assert read_manifest(out)["totals"]["documents"] == 6
    assert not (out / ".omniloom.lock").exists()  # released: the folder holds only the outputs
    # A holder killed with -9 leaves no lock behind: the kernel drops it, and a rerun resumes.
    out2 = tmp_path / "out2"
    p = _spawn_build(src, out2, "--shard-docs", "2", pause="0.2")
    _wait_for(lambda: any(f.name.endswith(".tar.tmp") for f in out2.iterdir()) if out2.exists() else False, "the second build")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert (out2 / ".omniloom.lock").exists()
    assert build([str(src)], str(out2), shard_max_docs=2, progress=False)["documents"] == 6


# --- item 5: file names that are not UTF-8, and every written JSON is valid UTF-8 ------------------


def _all_json_is_strict_utf8(out: Path) -> None:
    for name in os.listdir(out):
        if name.endswith(".tar"):
            import tarfile

            with tarfile.open(out / name) as tf:
                for m in tf:
                    if m.name.endswith(".doc.json"):
                        _strict_loads(tf.extractfile(m).read())
        elif name.endswith(".jsonl"):
            for line in (out / name).read_bytes().splitlines():
                _strict_loads(line)
        elif name.endswith(".json"):
            _strict_loads((out / name).read_bytes())


def test_file_names_that_are_not_utf8_are_escaped_and_json_stays_utf8(tmp_path):
    src = os.path.join(os.fsencode(tmp_path), b"src\xff")  # the SOURCE folder's own name too
    os.mkdir(src)
    with open(os.path.join(src, b"caf\xe9.txt"), "wb") as f:
        f.write(b"a Latin-1 name\n")
    with open(os.path.join(src, b"ok.txt"), "wb") as f:
        f.write(b"a plain name\n")
    os.symlink(b"nowhere", os.path.join(src, b"gone\xfe.png"))
    with open(os.path.join(src, b"d.jsonl"), "wb") as f:
        f.write(b'{"schema": 1, "segments": [{"type": "text", "text": "lone \\ud800 surrogate"}]}\n')
        f.write(b'{"schema": 1, "segments": [{"type": "text", "text": "fine"}], "meta": {"note": "x\\udfffy"}}\n')
    out = tmp_path / "out"
    s = build([os.fsdecode(src)], str(out), progress=False)
    assert s["documents"] == 3 and s["rejects"] == {"bad-utf8": 1, "missing": 1}
    _all_json_is_strict_utf8(out)
    docs = {d["meta"]["source"]: d for d in _docs(out)}
    assert "src\\xff/caf\\xe9.txt" in docs and docs["src\\xff/caf\\xe9.txt"]["segments"][0]["text"] == "a Latin-1 name\n"
    assert docs["src\\xff/d.jsonl:2"]["meta"]["note"] == "x\ufffdy"
    paths = {r["code"]: r["path"] for r in _rejects(out)}
    assert paths["missing"].endswith("src\\xff/gone\\xfe.png") and paths["bad-utf8"].endswith("d.jsonl:1")
    assert read_manifest(out)["settings"]["sources"][0].endswith("src\\xff")
    # The escaped form is stable: a rerun finds the finished build, and workers agree byte for byte.
    assert build([os.fsdecode(src)], str(out), progress=False)["already"]
    build([os.fsdecode(src)], str(tmp_path / "w2"), workers=2, progress=False)
    for name in os.listdir(out):
        assert (out / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


# --- item 6: legacy encodings declared by HTML pages, and text files with a BOM --------------------

WORD_PAGE = (
    '<html xmlns:v="urn:schemas-microsoft-com:vml" xmlns:o="urn:schemas-microsoft-com:office:office"\n'
    'xmlns:w="urn:schemas-microsoft-com:office:word" xmlns="http://www.w3.org/TR/REC-html40">\n\n<head>\n'
    '<meta http-equiv=Content-Type content="text/html; charset=windows-1252">\n'
    '<meta name=Generator content="Microsoft Word 15">\n<title>Caf\xe9 notes</title>\n</head>\n'
    '<body lang=EN-US><div class=WordSection1><p class=MsoNormal>Caf\xe9 cr\xe8me \u201cquoted\u201d \u2013 na\xefve</p></div></body></html>\n'
)


def test_declared_legacy_encodings_and_boms_are_honoured(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "word.htm").write_bytes(WORD_PAGE.encode("cp1252"))
    (src / "latin1.html").write_bytes('<meta charset="ISO-8859-1"><p>Gar\xe7on \u2019s</p>'.encode("cp1252"))
    (src / "sjis.html").write_bytes('<html><head><meta charset=shift_jis></head><body><p>日本語のページ</p></body></html>'.encode("shift_jis"))
    (src / "u16.html").write_bytes(codecs_bom("utf-16-le") + "<p>sixteen \u00e9</p>".encode("utf-16-le"))
    (src / "bomwins.html").write_bytes(b"\xef\xbb\xbf" + '<meta charset="windows-1252"><p>bom \u00e9</p>'.encode("utf-8"))
    (src / "be.txt").write_bytes(codecs_bom("utf-16-be") + "big-endian text \u00e9\n".encode("utf-16-be"))
    (src / "u8bom.md").write_bytes(b"\xef\xbb\xbf# heading \xc3\xa9\n")
    (src / "undeclared.html").write_bytes("<p>caf\xe9 with no declaration</p>".encode("latin-1"))
    out = tmp_path / "out"
    s = build([str(src)], str(out), progress=False)
    assert s["rejects"] == {"bad-utf8": 1}, _rejects(out)  # only the page that declares nothing
    assert _rejects(out)[0]["path"].endswith("undeclared.html")
    texts = {k: (" ".join(s["text"] for s in d["segments"]), d["meta"]) for k, d in _by_source(out).items()}
    text, meta = texts["word.htm"]
    assert text == "Caf\xe9 cr\xe8me \u201cquoted\u201d \u2013 na\xefve" and meta["title"] == "Caf\xe9 notes" and meta["encoding"] == "cp1252"
    assert texts["latin1.html"][0] == "Gar\xe7on \u2019s"  # ISO-8859-1 means windows-1252, as in browsers
    assert texts["sjis.html"][0] == "日本語のページ"
    assert texts["u16.html"][0] == "sixteen \u00e9" and texts["bomwins.html"][0] == "bom \u00e9"
    assert texts["be.txt"][0] == "big-endian text \u00e9\n" and texts["u8bom.md"][0] == "# heading \u00e9\n"
    # A page whose bytes do not fit its declaration is a counted reject, not mojibake.
    try:
        decode_text(b'<meta charset="utf-8"><p>caf\xe9</p>', TextPolicy(), what="page", html=True)
        raise AssertionError("expected a Reject")
    except Reject as rej:
        assert rej.code == "bad-encoding"
    assert decode_text("<meta charset=koi8-r><p>\u043f\u0440\u0438\u0432\u0435\u0442</p>".encode("koi8-r"), TextPolicy(), html=True).endswith("\u043f\u0440\u0438\u0432\u0435\u0442</p>")


def codecs_bom(codec: str) -> bytes:
    import codecs

    return {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE}[codec]


# --- item 6, undeclared: a legacy encoding is detected only when the guess is confident ------------

# A page as an old editor saves it: no <meta charset>, windows-1252 bytes (accents, curly quotes,
# an en dash, the euro sign at 0x80).
CP1252_PAGE = (
    "<html>\n<head>\n<title>Le caf\u00e9 de la gare</title>\n</head>\n<body>\n"
    "<h1>Le caf\u00e9 de la gare</h1>\n"
    "<p>Le matin, la boulang\u00e8re ouvre sa boutique \u00e0 six heures. Les croissants sont encore ti\u00e8des quand "
    "les premiers clients arrivent\u00a0: un \u00e9tudiant press\u00e9, une infirmi\u00e8re qui rentre de sa garde, un vieil "
    "homme qui lit \u201cLe Monde\u201d en buvant son caf\u00e9 cr\u00e8me.</p>\n"
    "<p>\u201c\u00c7a co\u00fbte 3,20\u00a0\u20ac, monsieur\u201d, dit-elle avec un sourire. Il r\u00e9pond qu\u2019il pr\u00e9f\u00e8re "
    "payer en esp\u00e8ces \u2013 comme toujours. Dehors, la rue s\u2019anime et l\u2019\u00e9glise sonne huit coups.</p>\n"
    "</body>\n</html>\n"
)

SJIS_TEXT = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で"
    "ニャーニャー泣いていた事だけは記憶している。吾輩はここで始めて人間というものを見た。しかもあとで聞くと"
    "それは書生という人間中で一番獰悪な種族であったそうだ。この書生というのは時々我々を捕えて煮て食うという話である。\n"
)
GB_TEXT = (
    "北京是中华人民共和国的首都，也是全国的政治和文化中心。这座城市有三千多年的建城史，拥有故宫、天坛、"
    "颐和园等众多名胜古迹。每年都有大量游客来到这里参观游览，感受中国传统文化的魅力。近年来，北京的交通"
    "和环境都有了很大的改善，地铁线路不断延伸，城市绿化面积也逐年增加。\n"
)


def test_an_undeclared_cp1252_page_is_detected_and_kept_and_rejected_under_utf8(tmp_path, capsys):
    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "cafe.html").write_bytes(CP1252_PAGE.encode("cp1252"))
    assert b"<meta" not in (src / "cafe.html").read_bytes() and b"\x80" in (src / "cafe.html").read_bytes()

    s = build([str(src)], str(tmp_path / "detect"), progress=False)
    assert s["documents"] == 1 and s["rejects"] == {"encoding-detected": 1}, _rejects(tmp_path / "detect")
    doc = _by_source(tmp_path / "detect")["cafe.html"]
    text = "\n".join(seg["text"] for seg in doc["segments"])
    assert "Ça coûte 3,20\u00a0€, monsieur" in text and "\u201cLe Monde\u201d" in text and "qu\u2019il préfère" in text
    assert doc["meta"]["title"] == "Le café de la gare"
    assert doc["meta"]["encoding"] == "cp1252" and doc["meta"]["encoding_source"] == "detected"
    (note,) = _rejects(tmp_path / "detect")
    assert note["code"] == "encoding-detected" and note["action"] == "decoded" and note["path"].endswith("cafe.html")
    assert "cp1252" in note["reason"] and "French" in note["reason"]

    s = build([str(src)], str(tmp_path / "strict"), progress=False,
              ingest=IngestSettings(text=TextPolicy(undeclared_encoding="utf-8")))
    assert s["documents"] == 0 and s["rejects"] == {"bad-utf8": 1}
    assert "--undeclared-encoding utf-8" in _rejects(tmp_path / "strict")[0]["reason"]

    # The command line: the option, and the summary listing the guess apart from the rejections.
    capsys.readouterr()
    assert main(["-q", "data", "build", str(src), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "rejected: 0" in out and "notices: encoding-detected 1 (inputs kept" in out
    assert main(["-q", "data", "build", str(src), "--out", str(tmp_path / "cli_utf8"), "--undeclared-encoding", "utf-8"]) == 2
    assert "rejected: 1 (bad-utf8 1)" in capsys.readouterr().out


def test_undeclared_shift_jis_and_gb18030_text_is_detected(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "neko.txt").write_bytes(SJIS_TEXT.encode("shift_jis"))
    (src / "beijing.md").write_bytes(GB_TEXT.encode("gb18030"))
    (src / "notes.py").write_bytes(("# " + GB_TEXT + "print('ok')\n").encode("gb18030"))  # code: the same decode path
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 3 and s["rejects"] == {"encoding-detected": 3}, _rejects(tmp_path / "out")
    docs = _by_source(tmp_path / "out")
    assert docs["neko.txt"]["segments"][0]["text"] == SJIS_TEXT
    assert docs["neko.txt"]["meta"]["encoding"] in ("cp932", "shift_jis")
    assert docs["beijing.md"]["segments"][0]["text"] == GB_TEXT and docs["beijing.md"]["meta"]["encoding"] == "gb18030"
    assert docs["notes.py"]["segments"][0] == {"type": "code", "lang": "python", "text": "# " + GB_TEXT + "print('ok')\n"}
    assert {d["meta"]["encoding_source"] for d in docs.values()} == {"detected"}


def test_random_binary_bytes_are_not_detected_as_text():
    rng = random.Random(14)
    for _ in range(20):
        noise = bytes(rng.randrange(1, 256) for _ in range(2048))  # no NULs, so --nul does not catch it
        high = bytes(rng.choice(range(0x80, 0x100)) if rng.random() < 0.7 else 0x20 for _ in range(2048))  # no controls either
        for data in (noise, high):
            det = detect_encoding(data)
            assert det.codec is None, (det, data[:32])
            with pytest.raises(Reject) as err:
                decode_text(data, TextPolicy())
            assert err.value.code == "bad-utf8" and "not detected with confidence" in err.value.reason
    assert "binary-looking" in detect_encoding(noise).why
    # Too little text to tell the language: a few accented letters fit a dozen code pages.
    with pytest.raises(Reject) as err:
        decode_text("caf\u00e9 cr\u00e8me\n".encode("latin-1"), TextPolicy())
    assert err.value.code == "bad-utf8" and "coherence" in err.value.reason
    # An unconfident guess follows --bad-utf8 replace as before: UTF-8 with U+FFFD, nothing guessed.
    assert decode_bytes(b"caf\xe9", TextPolicy(bad_utf8="replace")) == validate.Decoded("caf\ufffd", "utf-8", "utf-8")


def test_valid_utf8_never_reaches_the_detector(tmp_path, monkeypatch):
    def refuse(data, **kw):
        raise AssertionError(f"the detector ran on {data[:40]!r}")

    monkeypatch.setattr(validate, "detect_encoding", refuse)
    for text in ("plain ASCII\n", "Le café crème coûte 3,20 €\n", SJIS_TEXT, "<p>\u201cquoted\u201d</p>"):
        d = decode_bytes(text.encode("utf-8"), TextPolicy(), html=text.startswith("<"))
        assert (d.text, d.codec, d.source) == (text, "utf-8", "utf-8")
    # Neither does anything with a BOM or a declaration, nor JSON.
    assert decode_bytes(b"\xff\xfe" + "sixteen \u00e9".encode("utf-16-le"), TextPolicy()).source == "bom"
    assert decode_bytes(b"<meta charset=windows-1252><p>caf\xe9</p>", TextPolicy(), html=True).source == "declared"
    with pytest.raises(Reject) as err:
        decode_text(b'{"text": "caf\xe9 cr\xe8me"}', TextPolicy(), strict_utf8=True)
    assert err.value.code == "bad-utf8" and "JSON is UTF-8" in err.value.reason
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.html").write_text(CP1252_PAGE, encoding="utf-8")
    (src / "b.txt").write_text(GB_TEXT, encoding="utf-8")
    (src / "c.jsonl").write_text(json.dumps({"schema": 1, "segments": [{"type": "text", "text": "é"}]}) + "\n", encoding="utf-8")
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 3 and s["rejects"] == {}
    assert not any("encoding" in d["meta"] for d in _by_source(tmp_path / "out").values())


def test_declared_encodings_and_boms_win_over_detection(tmp_path):
    russian = ("В начале лета мы поехали в деревню к бабушке. Там было тихо и спокойно, только по утрам пели птицы "
               "и где-то вдалеке лаяла собака. Мы ходили за грибами в лес, купались в реке и пили парное молоко.\n")
    body = f"<p>{russian}</p>".encode("koi8-r")
    assert detect_encoding(body, html=True).codec == "koi8_r"  # what detection alone would say
    page = b"<meta charset=windows-1251>" + body  # a wrong declaration is still the page's word, as in browsers
    d = decode_bytes(page, TextPolicy(), html=True)
    assert (d.codec, d.source) == ("cp1251", "declared") and d.text == page.decode("cp1251")
    # A declaration that the bytes contradict is a bad-encoding reject, never a silent re-guess.
    with pytest.raises(Reject) as err:
        decode_text(b"<meta charset=utf-8>" + CP1252_PAGE.encode("cp1252"), TextPolicy(), html=True)
    assert err.value.code == "bad-encoding"
    # A UTF-8 BOM on otherwise undecodable bytes: the BOM decides, no detection.
    with pytest.raises(Reject) as err:
        decode_text(b"\xef\xbb\xbf" + russian.encode("cp1251"), TextPolicy())
    assert err.value.code == "bad-encoding"
    # Captions: a .txt sidecar is detected (recorded as caption_encoding), a .json sidecar stays UTF-8.
    from omniloom.data.prep.synth import make_image

    src = tmp_path / "src"
    make_image(src / "photo.png", size=(48, 32), seed=1)
    (src / "photo.txt").write_bytes(("Une photographie prise à l’aube depuis la fenêtre de la cuisine : "
                                     "la rivière, le pont et l’église du village sous la brume.").encode("cp1252"))
    make_image(src / "other.png", size=(48, 32), seed=2)
    (src / "other.json").write_bytes('{"caption": "la rivi\u00e8re et l\u2019\u00e9glise du village sous la brume"}'.encode("cp1252"))
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 2 and s["rejects"] == {"encoding-detected": 1, "bad-utf8": 1}, _rejects(tmp_path / "out")
    docs = _by_source(tmp_path / "out")
    assert docs["photo.png"]["segments"][1]["text"].startswith("Une photographie prise à l’aube")
    assert docs["photo.png"]["meta"]["caption_encoding"] == "cp1252" and docs["photo.png"]["meta"]["caption_encoding_source"] == "detected"
    by_code = {r["code"]: r for r in _rejects(tmp_path / "out")}
    assert by_code["encoding-detected"]["ref"] == "photo.txt" and by_code["bad-utf8"]["action"] == "dropped-caption"


def test_discovery_reads_a_pages_references_under_the_builds_encoding_setting(tmp_path):
    """Discovery decoded every page with detection to find the media it references, whatever
    --undeclared-encoding said. A non-ASCII `src` in an undeclared cp1252 page names `café.png`
    only when the page is decoded as cp1252; under utf-8 the build reads it with U+FFFD, so the
    image is not the one referenced and becomes a standalone document, as the build sees it."""
    src = tmp_path / "src"
    src.mkdir()
    page = CP1252_PAGE.replace("</h1>\n", "</h1>\n<img src=\"caf\u00e9.png\" alt=\"la gare\">\n")
    (src / "cafe.html").write_bytes(page.encode("cp1252"))
    (src / "caf\u00e9.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # never opened by discovery

    def standalone(**kw):
        return [u.rel for u in discover([str(src)], **kw) if u.kind == "image"]

    assert standalone() == []  # referenced by the page: not a document of its own
    assert standalone(undeclared_encoding="detect") == []
    assert standalone(undeclared_encoding="utf-8") == ["caf\u00e9.png"]


# --- item 12: a huge JSONL line is skipped without being loaded ------------------------------------


def test_a_huge_jsonl_line_is_rejected_without_loading_it(tmp_path):
    import tracemalloc

    src = tmp_path / "src"
    src.mkdir()
    line = lambda text: json.dumps({"schema": 1, "segments": [{"type": "text", "text": text}]}).encode() + b"\n"  # noqa: E731
    huge = 12 << 20
    with open(src / "docs.jsonl", "wb") as f:
        f.write(line("first"))
        f.write(b'{"schema": 1, "segments": [{"type": "text", "text": "')
        for _ in range(huge >> 20):
            f.write(b"x" * (1 << 20))
        f.write(b'"}]}')  # no newline: the huge line is also the last
    with open(src / "docs.jsonl", "rb+") as f:  # a line after it too
        f.seek(0, 2)
        f.write(b"\n" + line("last"))
    limit = 1 << 20
    tracemalloc.start()
    try:
        s = build([str(src)], str(tmp_path / "out"), progress=False, ingest=IngestSettings(text=TextPolicy(max_bytes=limit)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s["documents"] == 2 and s["rejects"] == {"too-large": 1}
    assert peak < 4 * limit, f"peak {peak / 1e6:.1f} MB while reading a {huge / 1e6:.0f} MB line with --max-text-bytes {limit}"
    (rej,) = _rejects(tmp_path / "out")
    assert rej["path"].endswith("docs.jsonl:2") and "above --max-text-bytes" in rej["reason"]
    assert [d["segments"][0]["text"] for d in _docs(tmp_path / "out")] == ["first", "last"]


# --- item 7: a video whose container promises more than it holds is flagged ----------------------

_CONTAINERS = [
    ("clip.mp4", dict(faststart=True)),  # MP4 with its index first: frame count declared
    ("clip_a.mp4", dict(faststart=True, audio=True)),
    ("clip.mkv", dict(codec="vp9", audio=True)),  # Matroska: duration in the header
    ("clip.webm", dict(codec="vp9")),
    ("clip25.mkv", dict(codec="mpeg4", audio=True, fps=25)),  # audio padded past the video
    ("clip.avi", dict(codec="mjpeg")),  # AVI: frame count declared
    ("clip_a.avi", dict(codec="mpeg4", audio=True, fps=24)),  # AVI counting skipped frame slots
    ("clip.flv", dict(codec="flv")),  # FLV: duration in onMetaData
]


def test_truncated_videos_are_rejected_and_complete_ones_kept(tmp_path):
    from omniloom.data.prep.media import MediaLimits, validate_video

    for name, kw in _CONTAINERS:
        full = make_video(tmp_path / name, frames=48, size=(32, 32), **kw).read_bytes()
        validate_video(full, MediaLimits())  # complete: accepted
        cut = full[: int(len(full) * 0.93)]
        try:
            info = validate_video(cut, MediaLimits())
        except Reject as rej:
            assert rej.code in ("truncated-video", "no-video-stream", "not-a-video"), (name, rej.code)
        else:
            raise AssertionError(f"{name} cut at 93% was accepted: {info}")


def test_verify_flags_a_truncated_video_inside_a_shard(tmp_path, capsys, monkeypatch):
    """The issue's case: 44 of 48 frames present. A build that lets it through (here: validation
    stubbed out, as an older omniloom would have) fails `data verify`."""
    import omniloom.data.prep.ingest as ingest
    from omniloom.pretrain.cli import main

    import io

    import av

    full = make_video(tmp_path / "full.mp4", frames=48, size=(32, 32), faststart=True).read_bytes()
    with av.open(io.BytesIO(full)) as c:
        pos = [p.pos for p in c.demux(c.streams.video[0]) if p.size]
    src = tmp_path / "src"
    src.mkdir()
    (src / "cut.mp4").write_bytes(full[: pos[44]])  # exactly 44 of the 48 frames left
    s = build([str(src)], str(tmp_path / "a"), progress=False)
    assert s["documents"] == 0 and s["rejects"] == {"truncated-video": 1}
    assert "48 video frames" in _rejects(tmp_path / "a")[0]["reason"]
    real = ingest.validate_video

    def lenient(data, limits):
        try:
            return real(data, limits)
        except Exception:  # noqa: BLE001
            return {"ext": "mp4", "frames": 48}

    monkeypatch.setattr(ingest, "validate_video", lenient)
    assert build([str(src)], str(tmp_path / "b"), progress=False)["documents"] == 1
    monkeypatch.setattr(ingest, "validate_video", real)
    capsys.readouterr()
    assert main(["-q", "data", "verify", str(tmp_path / "b")]) == 1
    assert "vid0.mp4 does not decode" in capsys.readouterr().out


# --- item 10: part builds plus a merge hold the same documents as one build -----------------------


def _by_key(out: Path) -> dict[str, dict[str, bytes]]:
    docs = {}
    for shard in read_manifest(out)["shards"]:
        for smp in shard["samples"]:
            key, members = iter_sample_at(out / shard["name"], smp["offset"])
            docs[key] = members
    return docs


def test_parts_plus_merge_drop_the_duplicates_a_single_build_drops(tmp_path, capsys):
    from omniloom.data.prep.merge import merge
    from omniloom.data.prep.synth import make_image
    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(20):  # the case: 20 identical files (two distinct texts, 10 copies each)
        (src / f"same{i:02d}.txt").write_text("the same words\n" if i % 2 else "other  words\n")
    for i in range(6):
        (src / "sub" / f"u{i}.txt").write_text(f"unique {i}\n")
        make_image(src / "sub" / f"img{i % 2}_{i}.png", size=(32, 32), seed=i % 2)  # two distinct images, 3 copies each
    one = build([str(src)], str(tmp_path / "one"), shard_max_docs=3, progress=False)
    assert one["documents"] == 2 + 6 + 2 and one["rejects"] == {"duplicate": 22}
    parts = []
    for i in range(4):
        build([str(src)], str(tmp_path / f"p{i}"), part=(i, 4), shard_max_docs=3, progress=False)
        parts.append(str(tmp_path / f"p{i}"))
    res = merge(parts, str(tmp_path / "merged"))
    merged, single = _by_key(tmp_path / "merged"), _by_key(tmp_path / "one")
    assert res["documents"] == one["documents"] and merged == single  # same keys, same bytes
    man, man1 = read_manifest(tmp_path / "merged"), read_manifest(tmp_path / "one")
    assert man["totals"]["segments"] == man1["totals"]["segments"] and man["totals"]["media_bytes"] == man1["totals"]["media_bytes"]
    assert man["rejects"]["by_code"] == {"duplicate": 22} and len(_rejects(tmp_path / "merged")) == 22
    assert all(set(smp) == {"key", "offset"} for sh in man["shards"] for smp in sh["samples"])
    capsys.readouterr()
    assert main(["-q", "data", "verify", str(tmp_path / "merged")]) == 0, capsys.readouterr().out
    # --mode move leaves nothing behind that the merged set needs, and gives the same documents.
    moved = []
    for i in range(4):
        build([str(src)], str(tmp_path / f"m{i}"), part=(i, 4), shard_max_docs=3, progress=False)
        moved.append(str(tmp_path / f"m{i}"))
    merge(moved, str(tmp_path / "merged2"), mode="move")
    assert _by_key(tmp_path / "merged2") == single
    assert not [f for d in moved for f in os.listdir(d) if f.endswith(".tar")]
    assert main(["-q", "data", "verify", str(tmp_path / "merged2")]) == 0


def test_part_builds_are_byte_identical_for_any_worker_count(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"t{i:02d}.txt").write_text(f"text {i % 5}\n")
    for w in (1, 2):
        build([str(src)], str(tmp_path / f"w{w}"), part=(1, 2), workers=w, shard_max_docs=2, progress=False)
    names = sorted(os.listdir(tmp_path / "w1"))
    assert names == sorted(os.listdir(tmp_path / "w2")) and "manifest.json" in names
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
