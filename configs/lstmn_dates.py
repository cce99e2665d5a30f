"""LSTMN (Cheng et al. 2016, shallow fusion) on dates: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/lstmn_dates.py --workdir=runs/lstmn_dates
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("lstmn", "dates")
