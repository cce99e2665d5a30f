"""luong on reverse: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/luong_reverse.py --workdir=runs/luong_reverse
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("luong", "reverse")
