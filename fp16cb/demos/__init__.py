"""Demos and experiments, built on the core package (which never imports them): the main job `python -m fp16cb`
(`cli`), its experiments table (`experiments`), and the multi-process demo `python -m fp16cb.demos.ddp` (`ddp`)."""
