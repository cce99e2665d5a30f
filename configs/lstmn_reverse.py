"""LSTMN (Cheng et al. 2016, shallow fusion) on reverse: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/lstmn_reverse.py --workdir=runs/lstmn_reverse
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("lstmn", "reverse")
