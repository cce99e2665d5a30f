"""rnnencdec on reverse: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/rnnencdec_reverse.py --workdir=runs/rnnencdec_reverse
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("rnnencdec", "reverse")
