"""Issue 14, item 6: text with no BOM and no declared charset that is not UTF-8 has its legacy
encoding detected (`--undeclared-encoding detect`) and is kept only when the guess is confident;
valid UTF-8 never reaches the detector; declarations and BOMs win over detection; JSON stays UTF-8."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from omniloom.data import validate
from omniloom.data.ingest import IngestSettings
from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.shards import build
from omniloom.data.textenc import detect_encoding
from omniloom.data.validate import Reject, TextPolicy, decode_bytes, decode_text

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


def test_an_undeclared_cp1252_page_is_detected_and_kept_and_rejected_under_utf8(tmp_path, capsys):
    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "cafe.html").write_bytes(CP1252_PAGE.encode("cp1252"))
    assert b"<meta" not in (src / "cafe.html").read_bytes() and b"\x80" in (src / "cafe.html").read_bytes()

    s = build([str(src)], str(tmp_path / "detect"), progress=False)
    assert s["documents"] == 1 and s["rejects"] == {"encoding-detected": 1}, _rejects(tmp_path / "detect")
    doc = _docs(tmp_path / "detect")["cafe.html"]
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
    docs = _docs(tmp_path / "out")
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
    assert not any("encoding" in d["meta"] for d in _docs(tmp_path / "out").values())


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
    from omniloom.data.synth import make_image

    src = tmp_path / "src"
    make_image(src / "photo.png", size=(48, 32), seed=1)
    (src / "photo.txt").write_bytes(("Une photographie prise à l’aube depuis la fenêtre de la cuisine : "
                                     "la rivière, le pont et l’église du village sous la brume.").encode("cp1252"))
    make_image(src / "other.png", size=(48, 32), seed=2)
    (src / "other.json").write_bytes('{"caption": "la rivi\u00e8re et l\u2019\u00e9glise du village sous la brume"}'.encode("cp1252"))
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 2 and s["rejects"] == {"encoding-detected": 1, "bad-utf8": 1}, _rejects(tmp_path / "out")
    docs = _docs(tmp_path / "out")
    assert docs["photo.png"]["segments"][1]["text"].startswith("Une photographie prise à l’aube")
    assert docs["photo.png"]["meta"]["caption_encoding"] == "cp1252" and docs["photo.png"]["meta"]["caption_encoding_source"] == "detected"
    by_code = {r["code"]: r for r in _rejects(tmp_path / "out")}
    assert by_code["encoding-detected"]["ref"] == "photo.txt" and by_code["bad-utf8"]["action"] == "dropped-caption"


def test_discovery_reads_a_pages_references_under_the_builds_encoding_setting(tmp_path):
    """Discovery decoded every page with detection to find the media it references, whatever
    --undeclared-encoding said. A non-ASCII `src` in an undeclared cp1252 page names `café.png`
    only when the page is decoded as cp1252; under utf-8 the build reads it with U+FFFD, so the
    image is not the one referenced and becomes a standalone document, as the build sees it."""
    from omniloom.data.ingest import discover

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
