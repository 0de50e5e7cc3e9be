"""Data prep: `omniloom data build` and its tools, from raw files to shards.

    units.py       input kinds by name, Unit (one input), IngestSettings, the chunked line reader
    ingest.py      discover inputs, one input unit -> one validated document
    foreign.py     WebDataset tars written by other tools (img2dataset, video2dataset)
    textcorpus.py  {"text"} JSONL corpora and compressed inputs (.gz .zst .bz2 .xz)
    parquet.py     parquet as `datasets` and the Hub write it
    index.py       `data index`: foreign shards indexed in place (the stream reads them)
    sniff.py       what a file name does not say: earlier builds, probed media, animated images
    validate.py    text policy, JSONL layouts, fingerprints, paths kept inside their root
    media.py       image and video validation;  textenc.py  encodings;  html_doc.py  HTML pages
    shards.py      the deterministic, resumable shard writer;  merge.py  `data merge`
    inspect.py     `data inspect` / `verify`;  synth.py, demo_corpus.py  generated corpora
    build_bench.py, foreign_bench.py   `omniloom bench data`

Imports the data root (manifest, outlock, progress, config), never data.stream.
"""
