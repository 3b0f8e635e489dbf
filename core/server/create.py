"""(being written)"""

import quart

bp = quart.Blueprint("create", __name__)
