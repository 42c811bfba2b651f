/* gptoss.c - the attention sink's softmax and the clamped SwiGLU (see gptoss.h). */
#include "model/gptoss.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void kvr_softmax_sink(float *scores, uint32_t n, float sink)
{
    float m = sink;
    for (uint32_t i = 0; i < n; i++)
        m = scores[i] > m ? scores[i] : m;
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        scores[i] = expf(scores[i] - m);
        sum += scores[i];
    }
    sum += expf(sink - m);
    float inv = (float)(1.0 / sum);
    for (uint32_t i = 0; i < n; i++)
        scores[i] *= inv;
}

void kvr_swiglu_oai(float *gate, const float *up, size_t n)
{
    const float alpha = 1.702f, limit = 7.0f;
    for (size_t i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit;
        float u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        gate[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}
