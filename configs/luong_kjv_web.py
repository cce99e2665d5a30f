"""luong on kjv_web: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/luong_kjv_web.py --workdir=runs/luong_kjv_web
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("luong", "kjv_web")
