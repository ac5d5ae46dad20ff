"""The sections of ``benchmarks/gpu_check.py``, one module each.

``_common`` (inputs, timing, ulp distances), ``_parity`` (kernels against their references),
``_bandwidth`` (kernels and XLA against a device copy; the launch candidates; the auto table),
``_memory`` (``peak_bytes_in_use`` of a ResNet-18 step) and ``_end_to_end`` (the main job's three
runs). ``gpu_check.py`` parses the arguments and runs the sections asked for.
"""
