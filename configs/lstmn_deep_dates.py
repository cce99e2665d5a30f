"""LSTMN with deep fusion (Cheng et al. 2016, arXiv:1601.06733v7 eqs. 14-15) on dates: configs/lstmn_dates.py otherwise.

python train.py --config=configs/lstmn_deep_dates.py --workdir=runs/lstmn_deep_dates
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("lstmn", "dates", fusion="deep")
