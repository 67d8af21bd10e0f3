"""The compiler: knobs (the user's words) -> resolve (every rule) -> builder passes -> order -> lower -> Program. Reads model/, ir/ and plan/."""
