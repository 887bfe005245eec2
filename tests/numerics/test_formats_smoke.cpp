#include <gtest/gtest.h>

#include "numerics/formats.h"

using namespace quads::num;

// Every E2M1 code decodes to a value that encodes back to the same code.
TEST(FormatsSmoke, E2M1RoundTripsEveryCode) {
  for (int c = 0; c < 16; ++c) {
    if (c == 8) continue;  // -0 encodes as 0x8 too, checked below
    EXPECT_EQ(e2m1_from_f32(e2m1_to_f32(c)), c) << c;
  }
  EXPECT_EQ(e2m1_from_f32(-0.f), 0x8);
  EXPECT_EQ(e2m1_to_f32(0x7), 6.f);
  EXPECT_EQ(e2m1_from_f32(0.25f), 0x0);  // tie to even: 0
  EXPECT_EQ(e2m1_from_f32(0.75f), 0x2);  // tie to even: 1.0
  EXPECT_EQ(e2m1_from_f32(100.f), 0x7);
}
