"""``storch-bench``: train discrete-latent models on real data with any estimator of the catalog.

The models of the ARM / DisARM / GSB papers (sigmoid belief networks, Bernoulli and categorical VAEs),
the standard data sets (scikit-learn's digits by default, binarized MNIST, MNIST, Fashion-MNIST read
from a directory), every estimator of `storch.method` that applies to the model's latents, an
equal budget of cost evaluations per datum, and the usual metrics (train/valid/test −ELBO, the
importance-weighted bound on the test set, the log-variance of the encoder's gradient, ms per step).

Run ``storch-bench --help`` (or ``python -m storch.bench --help``) and ``storch-bench list``.
"""

from storch.bench.data import DATASETS, load_dataset
from storch.bench.estimators import ESTIMATORS, build_methods, samples_for_budget
from storch.bench.models import MODELS, make_model

__all__ = ["DATASETS", "ESTIMATORS", "MODELS", "build_methods", "load_dataset", "make_model",
           "samples_for_budget"]
