"""rnnencdec on kjv_web: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/rnnencdec_kjv_web.py --workdir=runs/rnnencdec_kjv_web
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("rnnencdec", "kjv_web")
