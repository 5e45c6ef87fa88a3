"""
Small data sets built offline, for tutorials and tests.
"""

from __future__ import annotations

import torch

#: Column names of the ``x`` returned by :func:`titanic`.
feature_names = ("intercept", "class", "sex", "age")

# Passenger and crew counts of the Titanic, indexed [survived, age, sex, class]: survived 0 = no, 1 = yes;
# age 0 = child, 1 = adult; sex 0 = male, 1 = female; class 0..3 = 1st, 2nd, 3rd, crew.
_TITANIC_COUNTS = torch.tensor(
    [
        [[[0, 0, 35, 0], [0, 0, 17, 0]], [[118, 154, 387, 670], [4, 13, 89, 3]]],
        [[[5, 11, 13, 0], [1, 13, 14, 0]], [[57, 14, 75, 192], [140, 80, 76, 20]]],
    ]
)


def titanic(dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The Titanic survival data: the 2201 people aboard, from the classic 2 × 2 × 2 × 4 table of
    Class × Sex × Age × Survived, for logistic regression of survival on class, sex and age (the FALD
    paper's experiment).

    Columns of ``x`` (see :data:`feature_names`), each of the last three standardised to mean 0 and standard
    deviation 1 (population, divisor 2201) over the 2201 rows:

    - ``intercept``: 1.
    - ``class``: ordinal, 0 = 1st, 1 = 2nd, 2 = 3rd, 3 = crew, before standardising.
    - ``sex``: 1 = male, 0 = female, before standardising.
    - ``age``: 1 = adult, 0 = child, before standardising.

    The standardised values are monotone in the raw codes, so a larger value means a lower class (or crew),
    male, or adult. ``y`` is 1 for survivors (711) and 0 otherwise (1490). Rows expand the table in a fixed
    order, that of R's ``as.data.frame(Titanic)``: class varies fastest, then sex (male, female), age
    (child, adult) and survived (no, yes).

    **References**

    [1] R. J. MacG. Dawson (1995), "The 'Unusual Episode' Data Revisited", Journal of Statistics Education
        3(3).

    [2] R Core Team, ``datasets::Titanic``.

    :param torch.dtype dtype: floating point type of ``x`` and ``y`` (default: torch's default dtype, the
        dtype of a prior such as ``dist.Normal(0.0, 1.0)``).
    :returns: ``(x, y)`` of shapes ``[2201, 4]`` and ``[2201]``, on torch's default device.
    :rtype: tuple[torch.Tensor, torch.Tensor]
    """
    device, dtype = torch.get_default_device(), dtype or torch.get_default_dtype()
    with torch.device("cpu"):  # built from the table on the host, then placed like any new tensor
        survived, age, sex, class_ = (
            grid.flatten().repeat_interleave(_TITANIC_COUNTS.flatten())
            for grid in torch.meshgrid(*(torch.arange(n) for n in _TITANIC_COUNTS.shape), indexing="ij")
        )
        features = torch.stack([class_, 1 - sex, age], dim=-1).to(dtype)
        features = (features - features.mean(0)) / features.std(0, correction=0)
        x = torch.cat([torch.ones(len(features), 1, dtype=dtype), features], dim=-1)
    return x.to(device), survived.to(device, dtype)


def titanic_split(
    test_size: int = 441, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    :func:`titanic` split uniformly at random into a training and a test set (the FALD paper tests on 441
    points). The features are standardised over all 2201 rows, before the split.

    :param int test_size: number of test points, ``1 <= test_size <= 2200``.
    :param int seed: seed of the split (a local generator; the global torch RNG is untouched).
    :param torch.dtype dtype: floating point type of the tensors.
    :returns: ``(x_train, y_train, x_test, y_test)``.
    :rtype: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """
    x, y = titanic(dtype)
    if not 1 <= test_size < len(y):
        raise ValueError(f"test_size must be in 1..{len(y) - 1}, got {test_size}")
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed), device="cpu").to(y.device)
    test, train = perm[:test_size], perm[test_size:]
    return x[train], y[train], x[test], y[test]
