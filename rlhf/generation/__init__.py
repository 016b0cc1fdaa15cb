"""Generation engines behind one protocol (base.Engine): HF generate now; vLLM colocated/async plug in here."""
