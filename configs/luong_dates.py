"""luong on dates: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/luong_dates.py --workdir=runs/luong_dates
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("luong", "dates")
