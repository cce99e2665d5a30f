"""LSTMN (Cheng et al. 2016, shallow fusion) on kjv_web: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/lstmn_kjv_web.py --workdir=runs/lstmn_kjv_web
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("lstmn", "kjv_web")
