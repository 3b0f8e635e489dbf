"""(being written)"""

import quart

bp = quart.Blueprint("extras", __name__)
