"""The adaptive worker's decode step kinds, one module each (docs/ARCHITECTURE.md §3): ``chain`` (a width b <= B
with a draft), ``plain`` and ``width1`` (speculation off: a plain decode step, or the anchor verified alone),
``tree`` (DDTree, b > B) and ``ragged`` (a width per request). They share ``context`` (the step's inputs, the
verify-width swap), ``window`` (the step's KV window and its plan), ``draft``, ``verify``, ``accept`` and
``draft_kv`` (the committed tokens' features appended to the draft KV)."""
