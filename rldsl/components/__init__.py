"""All components, one module per slot. Importing this package registers them."""
from . import (  # noqa: F401
    aggregation,
    baseline,
    correction,
    critic,
    data,
    entropy,
    filter,
    kl,
    normalizer,
    objective,
    ratio,
    selection,
    shaping,
    trust_region,
)
