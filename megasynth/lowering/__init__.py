"""The schedule compiler: a model spec and a strategy in, a complete schedule out (`lower`), explicit edits on it
(`patches`), and its time estimated without a GPU (`costmodel`). Imports nothing from synth's search or runs."""
