"""Using a trained model: open it (an export or a run), score held-out data, caption, generate.

    load.py      open_model, load_export_tokenizer
    evaluate.py  `omniloom eval`: loss per modality, the cross-modal gap
    captions.py  `omniloom eval --captions`: greedy captions and probes
    generate.py  `omniloom generate`: sampling with a KV cache
    cli.py       `omniloom eval`, `omniloom generate`

Never imports train/ or export/.
"""
