"""The machinery every method rests on: how a model is run, watched and changed for one call.

    scope.py          CallScope: hooks and modes that belong to one call and one thread, always removed
    capture.py        forward hooks for feature maps, tensor hooks for gradients, layers by name, the model's state
    edit.py           a layer's output replaced for a call (ablation, masking)
    rules.py          call-scoped rules: how a torch function or module type is computed or differentiated
    attention.py      attention probabilities recorded, fused kernels computed step by step
    layers.py         a model's layers listed with their output shapes
    layouts.py        where the tokens or channels of a layer's output are (CNN maps, ViT tokens)
    windows.py        windowed attention (Swin) and its token layout
    targets.py        what to explain (a class, top-k, a region, a callable) → scalar scores
    units.py          hidden units (channels, neurons) as targets
    forward_call.py   a model's other inputs, passed to every forward a method makes
    memory_format.py  channels-last models and inputs
    checks.py         checks on values that are deferred to one device synchronisation
    caller.py         warnings attributed to the caller's line
    call_record.py    the batch of the explain call in progress and the model's passes it ran
"""
