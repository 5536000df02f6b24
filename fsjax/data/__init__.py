"""Data: the packaged corpus and tokenizer (`tokenizer`), grain pipelines that pack documents into training
rows (`pipeline`), and recall/switch masks for recall-weighted training (`recall`).

Nothing is imported here, so `fsjax.data.recall` and `fsjax.data.tokenizer` load without grain.
"""
