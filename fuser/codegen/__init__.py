"""codegen: a kernel's source rendered from a Jinja template, written to the kernel
cache and run from the rendered text (:mod:`~fuser.codegen.kernel_cache`).

Takes a :class:`~fuser.codegen.emit.KernelSpec` (template, pattern parameters or a row
program); returns the kernel's file and its launcher (:func:`~fuser.codegen.emit.emit`), with
warps from the GPU's launch table (:mod:`~fuser.codegen.launch_config`) and no compile allowed
inside a CUDA-graph capture (:mod:`~fuser.codegen.capture_guard`).
"""
