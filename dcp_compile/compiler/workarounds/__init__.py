"""Workarounds for how torch behaves in the version dcp is written against (2.13.0).

Each module here exists because Dynamo, AOTAutograd, Inductor or the shape environment behaves some
way in this torch version, and could go when torch changes. They are leaves: the core (``backend``,
``dispatcher``, ``inner_compilers``, ``regions``) imports them; they import nothing of dcp's but
each other, never the backend or the dispatcher (``tests/test_workarounds_package.py``). One line
each: what torch does, the version, the upstream issue, the test that fails without it.

- ``inductor_patches``: Inductor sorts symbolic strides without the shape environment (``TypeError``
  on ``H*W`` token counts) and its value ranges raise on a negative power; torch <= 2.13;
  pytorch/pytorch#172204 (fix proposed in #185871), the power: no upstream issue filed;
  tests/test_inductor_patches.py.
- ``invariant_divisions``: Inductor's C++ tiling ``sympy.simplify``-s whole index expressions, slow
  on ``FloorDiv`` (compile time only); torch 2.13.0; no upstream issue filed;
  tests/test_invariant_divisions.py.
- ``dynamic_output_shapes``: AOTAutograd's joint trace raises ``DynamicOutputShapeException`` for a
  backward ``nonzero``; torch 2.13.0; related: pytorch/pytorch#114686;
  tests/test_data_dependent_shapes.py.
- ``free_integers``: Dynamo passes an ``int`` across a graph break as a free symbolic input; torch
  2.13.0; no upstream issue filed; tests/test_free_integers.py.
- ``specialised_sizes``: Dynamo specialises sizes 0 and 1 under ``dynamic=True`` (a new graph, said
  why); torch 2.13.0; no upstream issue filed (documented behaviour); tests/test_progress.py.
- ``trace_hints``: the shape environment answers undecidable size questions from the first call's
  hints; torch 2.13.0; no upstream issue filed; tests/test_first_trace_hints.py.

Not here, though torch-shaped: ``compiler/custom_autograd.py`` (the pre-dispatch re-trace records
only a custom ``autograd.Function``'s forward) is imported by ``passes/sequence_dims``, which
was not to be edited when this package was made.
"""
