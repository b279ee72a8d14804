"""HiQCache's tools, one folder per concern (run from the repository root):

- ``overlay.py``: apply / check / refresh / wheel / pr / install of the patch series.
- ``common/``: what the tools share: SGLang on CPU with the stand-ins, the host
  formats every tool iterates over, one server helper (``server.py``, also under
  tests.support.server) and one plot helper (``plot.py``).
- ``demo/``: ``python -m scripts.demo`` (``make demo``), capacity and cache-hit replay.
- ``quality/``: ``python -m scripts.quality`` (``make quality``), restored-KV quality.
- ``bench/``: ``python -m scripts.bench.codec`` (``make bench-codec``) and one-off measurements.
"""
