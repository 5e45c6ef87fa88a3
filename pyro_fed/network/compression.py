r"""Compression of the clients' uploads: the part of the communication layer that decides how many bits a
message costs.

A compressor is a pure tensor map ``compress(v, uniforms)`` of vectors ``[..., d]`` (its randomness given as
uniform draws of the same shape, drawn ahead like every other randomness of an iteration) with a host-side
``bits(d)``, the cost of one message, and ``omega(d)``, the bound :math:`\omega` of its relative variance
:math:`E\|Q(v) - v\|^2 \le \omega \|v\|^2`. A new compressor subclasses :class:`Compressor`; the kernels
never look inside.

**Reference:** Alistarh, Grubic, Li, Tomioka, Vojnovic, *QSGD: Communication-efficient SGD via gradient
quantization and encoding*, NeurIPS 2017; as used by Vono, Plassier, Durmus, Dieuleveut, Moulines,
*QLSD: Quantised Langevin stochastic dynamics for Bayesian federated learning*, AISTATS 2022, eq. (4).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..data.partition import integral
from .base import BITS_PER_FLOAT


class Compressor:
    """No compression: the message is the vector, ``32 d`` bits."""

    #: whether :meth:`compress` uses its uniforms (the kernels draw them only then)
    random = False

    def compress(self, v: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """The message sent for the vectors ``v`` (``[..., d]``), given ``uniforms`` of the same shape when
        :attr:`random`."""
        return v

    def bits(self, dim: int) -> float:
        """Bits of one message of ``dim`` numbers."""
        return float(BITS_PER_FLOAT * dim)

    def omega(self, dim: int) -> float:
        """:math:`\\omega`: :math:`E\\|Q(v) - v\\|^2 \\le \\omega \\|v\\|^2`."""
        return 0.0


class StochasticQuantizer(Compressor):
    r"""The QSGD stochastic quantiser with ``levels`` :math:`s` levels per coordinate:

    .. math::

        Q_s(v)_j = \|v\| \,\mathrm{sign}(v_j)\, \xi_j / s, \qquad
        \xi_j = l_j + \mathrm{Ber}(s|v_j|/\|v\| - l_j), \quad l_j = \lfloor s |v_j| / \|v\| \rfloor,

    and :math:`Q_s(0) = 0`. It is unbiased, :math:`E[Q_s(v)] = v`, with
    :math:`E\|Q_s(v) - v\|^2 \le \omega \|v\|^2`, :math:`\omega = \min(d/s^2, \sqrt d / s)`. "``p`` bits"
    means :math:`s = 2^p`.

    :param int levels: :math:`s \ge 1`.

    Example: a message of ``d = 50`` floats quantised with 16 bits per level costs about 2.6 times fewer bits
    than sending it uncompressed (``32 d = 1600``):

        >>> quantizer = StochasticQuantizer(2**16)
        >>> round(quantizer.bits(50), 1), round(32 * 50 / quantizer.bits(50), 2)
        (613.7, 2.61)
        >>> quantizer.compress(torch.zeros(3), torch.rand(3))  # the zero vector is sent exactly
        tensor([0., 0., 0.])
    """

    random = True

    def __init__(self, levels: int):
        self.levels = levels

    def compress(self, v: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        norm = v.norm(dim=-1, keepdim=True)
        # where the norm is 0 the vector is 0 and so is its quantisation (no division by zero)
        scaled = self.levels * v.abs() / torch.where(norm > 0, norm, torch.ones_like(norm))
        lower = scaled.floor()
        levels = lower + (uniforms < scaled - lower).to(v.dtype)
        return norm * v.sign() * levels / self.levels

    def bits(self, dim: int) -> float:
        r"""The Elias-coding bound of QSGD on the bits of one quantised message (natural logarithms, as the
        QLSD paper computes it), plus 32 bits for the norm:

        - :math:`s \le \sqrt{d/2 - \sqrt d}`: :math:`(3 + \tfrac32 \ln\frac{2(s^2 + d)}{s(s + \sqrt d)})\,
          s(s + \sqrt d) + 32`;
        - otherwise: :math:`\big(\tfrac12(\ln(1 + \frac{s^2 + \min(d, s\sqrt d)}{d}) + 1) + 2\big)\, d + 32`.
        """
        s, d = float(self.levels), float(dim)
        if d / 2 - math.sqrt(d) > 0 and s <= math.sqrt(d / 2 - math.sqrt(d)):
            sparse = s * (s + math.sqrt(d))
            return (3 + 1.5 * math.log(2 * (s * s + d) / sparse)) * sparse + BITS_PER_FLOAT
        return ((math.log(1 + (s * s + min(d, s * math.sqrt(d))) / d) + 1) / 2 + 2) * d + BITS_PER_FLOAT

    def omega(self, dim: int) -> float:
        return min(dim / self.levels**2, math.sqrt(dim) / self.levels)


def compressor(quantization_levels: int | None) -> Compressor:
    """The compressor of a kernel's ``quantization_levels`` argument (``None``: none): a positive integer of
    any integer type (a Python int, a NumPy integer, a 0-d integer tensor); floats (``16.0`` too) and bools
    are refused, naming the value."""
    if quantization_levels is None:
        return Compressor()
    levels = integral(quantization_levels)
    if levels is None or levels < 1:
        number = isinstance(quantization_levels, numbers.Number) or (
            isinstance(quantization_levels, torch.Tensor) and quantization_levels.numel() == 1
        )
        hint = (
            " Pass int(quantization_levels) if it holds a whole number."
            if levels is None and number and not isinstance(quantization_levels, bool)
            else ""
        )
        raise ValueError(
            f"quantization_levels must be a positive integer (s levels per coordinate, e.g. 2**8, of any "
            f"integer type) or None (no compression); got {quantization_levels!r}.{hint}"
        )
    return StochasticQuantizer(levels)
