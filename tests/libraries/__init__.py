"""Training loops owned by other libraries (pytorch-ignite's Engine, accelerate's Accelerator, mmengine's OptimWrapper
and Runner), run bare, under ``safeloop.watch`` and with ``safeloop.GraphGuard``: the library's own code, not a copy.
Skipped unless the library is installed: ``pip install pytorch-ignite accelerate mmengine-lite opencv-python-headless``.
"""
