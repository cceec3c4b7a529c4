#!/usr/bin/env bash
# The live page's pictures in docs/live-view.md: the suite's Chromium check
# (LivePage.FourMomentsOfARunAreDrawnAsTheyAre) photographs the page at four
# moments of a made-up run into build/test-artifacts/; this runs that check
# and copies the pictures beside the doc.
#
#   scripts/live_view_shots.sh        # build/ built, Debian's chromium installed
set -euo pipefail
cd "$(dirname "$0")/.."
build/noloco_tests --gtest_filter=LivePage.FourMomentsOfARunAreDrawnAsTheyAre
for moment in before_evaluation one_evaluation mid_run finished; do
  cp "build/test-artifacts/live_view_$moment.png" "docs/live-view-$moment.png"
done
echo "docs/live-view-{before_evaluation,one_evaluation,mid_run,finished}.png"
