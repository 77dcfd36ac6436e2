"""Run store, mean ± std tables over seeds, and plots (``fedlore report``)."""
