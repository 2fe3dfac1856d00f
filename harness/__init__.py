"""Development harness: what tests, benchmarks, load tests and model training use, never the product.

`server` starts real `dflash-serve serve` processes; `simulator` and `workload` replay the controller against a
roofline cost model and synthetic acceptance traces. The product packages (`sglang_ext`, `service`) never import
this package (tests/unit/test_layering.py).
"""
