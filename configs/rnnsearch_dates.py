"""rnnsearch on dates: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/rnnsearch_dates.py --workdir=runs/rnnsearch_dates
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("rnnsearch", "dates")
