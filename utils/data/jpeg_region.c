/* Decode one rectangle of a JPEG with libjpeg(-turbo), built and loaded by utils/data/jpeg_region.py.
 *
 * A mosaic shows only part of each tile. Rows below the rectangle are never decoded, rows above it are
 * skipped without the inverse DCT and colour conversion, and columns outside it are cropped, so the work
 * is a fraction of decoding the whole file. The pixels equal those of a whole decode (same library, same
 * integer IDCT and fancy upsampling); the tests check this against OpenCV.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

enum { REGION_OK = 0, REGION_BROKEN = 1, REGION_UNSUPPORTED = 2 };

struct guard {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) { longjmp(((struct guard *)cinfo->err)->jump, 1); }

/* Warnings (corrupt data, premature end) are counted, never printed: the caller falls back. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) cinfo->err->num_warnings++;
}

/* Decode columns [x0, x1) of rows [y0, y1) of the JPEG in data into out (BGR, rows out_stride bytes apart).
 * width and height are the stored size the caller expects; the caller has checked that the file has no EXIF
 * rotation (utils/data/image_io.py reads the orientation). REGION_UNSUPPORTED: another size or a colour space
 * other than YCbCr, RGB and grey; REGION_BROKEN: an error or warning while decoding. The caller decodes the
 * whole file then. */
int decode_region(const unsigned char *data, unsigned long size, int width, int height, int x0, int y0, int x1,
                  int y1, unsigned char *out, long out_stride) {
    struct jpeg_decompress_struct cinfo;
    struct guard err;
    unsigned char *volatile row = NULL;
    volatile int status = REGION_OK;

    if (x0 < 0 || y0 < 0 || x1 > width || y1 > height || x1 <= x0 || y1 <= y0) return REGION_UNSUPPORTED;
    memset(&cinfo, 0, sizeof cinfo);  /* jpeg_destroy_decompress is safe on it whenever an error jumps back */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(row);
        return REGION_BROKEN;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);

    if ((int)cinfo.image_width != width || (int)cinfo.image_height != height ||
        (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_RGB &&
         cinfo.jpeg_color_space != JCS_GRAYSCALE)) {
        jpeg_destroy_decompress(&cinfo);
        return REGION_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_EXT_BGR;
    jpeg_start_decompress(&cinfo);

    /* One spare column each side: the edge columns of a cropped scanline lack a chroma neighbour when
     * upsampling, so they may differ from a whole decode; the spare ones are decoded but not copied. */
    JDIMENSION xoff = x0 > 0 ? x0 - 1 : 0, xwidth = (x1 < width ? x1 + 1 : width) - xoff;
    jpeg_crop_scanline(&cinfo, &xoff, &xwidth);
    row = malloc((size_t)xwidth * 3);
    if (row == NULL) longjmp(err.jump, 1);
    JSAMPROW rows[1] = {row};
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) status = REGION_BROKEN;
    size_t n = (size_t)(x1 - x0) * 3;
    for (int y = y0; y < y1 && status == REGION_OK; y++) {
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) status = REGION_BROKEN;
        else memcpy(out + (size_t)(y - y0) * out_stride, row + ((size_t)x0 - xoff) * 3, n);
    }
    if (err.pub.num_warnings) status = REGION_BROKEN;
    jpeg_abort_decompress(&cinfo);  /* the rows below are not needed */
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return status;
}
