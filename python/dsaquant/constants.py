"""The option strings every op takes, as str-enums (`dsaquant.Rounding.RNE == "rne"`) and tuples. Plain strings
work everywhere too. Generated from the integer codes of codes.py, where each option is defined once."""
from enum import Enum

from . import codes
from .codes import FP8_FLAVOURS, LAYOUTS, ROUNDINGS, SCALE_RULES  # noqa: F401


def _options(enum) -> type[Enum]:
    """A str-enum of the option strings of codes enum `enum` (member NAME = "name"), in code order."""
    return Enum(enum.__name__, [(n.upper(), n) for n in codes.names(enum)], type=str, module=__name__)


Rounding = _options(codes.Rounding)   # SPEC §2 rounding policies of FP4 codes
Layout = _options(codes.Layout)       # SPEC §6 cache layouts
