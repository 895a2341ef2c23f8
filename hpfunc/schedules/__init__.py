"""Pipeline schedules as data (placeholder; filled below)."""
from .ir import *  # noqa
from .generators import *  # noqa
from .validate import *  # noqa
from .simulate import *
