"""The eval tasks as data: one YAML record per task under records/ (an lm-eval task overlay plus our keys), read by
one registry (registry.py). The rest of the eval stage asks the registry, never a task's name."""
